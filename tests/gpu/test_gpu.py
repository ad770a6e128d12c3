"""GPU checks (``pytest -m gpu`` on a CUDA machine): every family against the oracle on CUDA,
with CUDA graphs (decode steps, and steps with a prompt chunk where the model allows) and without."""
from __future__ import annotations

import math
import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.worker.mixed_graphs import mixed_graphs_apply
from tests.support.models import ARCH_OPTIONS, ARCHS
from tests.support.oracle import Reference, assert_matches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILIES = list(dict.fromkeys(ARCHS + tuple(ARCH_OPTIONS)))  # every one decodes in CUDA graphs


def prompts_for_test() -> list[list[int]]:
    rng = random.Random(8)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return ([[rng.randrange(3, 500) for _ in range(n)] for n in (1, 70, 200, 33, 150, 9)]
            + [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 60)])


@pytest.mark.parametrize("enforce_eager, layout", [(False, "layer-major"), (True, "layer-major"), (False, "page-major")],
                         ids=["graphs", "eager", "graphs-page-major"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_float32_matches_oracle(arch, enforce_eager, layout, model_dirs, oracles, monkeypatch):
    """Greedy tokens equal and top-5 logprobs within 1e-3 (GPU reduction order differs), with
    chunked prefill, prefix hits and preemption forced by a small pool; the state pools in
    ``layout`` (``--kv-cache-layout``)."""
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)
    prompts = prompts_for_test()
    llm = LLM(model=model_dirs[arch], device="cuda", dtype="float32", page_size=16, max_total_tokens=480,
              max_num_batched_tokens=128, max_num_seqs=8, indexer_cache_dtype="float32",
              enforce_eager=enforce_eager, kv_cache_layout=layout)
    runner = llm.engine.runner
    assert (runner.graphs is not None) == (not enforce_eager)
    # steps with a prompt chunk replay mixed-step graphs where the model's stateful layers allow
    mixed = runner.mixed_graphs
    assert (mixed is not None) == (not enforce_eager and mixed_graphs_apply(runner.model))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0
    assert mixed is None or mixed.num_replays > 0
    for output, prompt in zip(outputs, prompts):
        reference: Reference = oracles[arch].greedy(prompt, 16)
        assert_matches(output.outputs[0], reference, context=arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_bfloat16_runs(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], device="cuda", dtype="bfloat16", max_total_tokens=1024)
    prompts = [list(range(3, 50)), list(range(7, 300))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))
    for output in outputs:
        assert len(output.outputs[0].token_ids) == 8
        values = [entry.logprob for position in output.outputs[0].logprobs for entry in position.values()]
        assert values and all(math.isfinite(value) for value in values)
    llm.engine.check_all_free()


def test_sampled_decoding_on_graphs_is_seeded(model_dirs):
    """Seeded sampling gives the same tokens with and without CUDA graphs."""
    prompts = [list(range(3, 40)), list(range(5, 90))]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    results = []
    for enforce_eager in (False, True):
        llm = LLM(model=model_dirs["llama"], device="cuda", dtype="float32", max_total_tokens=1024,
                  enforce_eager=enforce_eager)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.engine.check_all_free()
    assert results[0] == results[1]


@pytest.mark.parametrize("arch", FAMILIES)
def test_decode_launched_early_matches_oracle_and_the_plain_launch(arch, model_dirs, oracles, monkeypatch):
    """Decode steps of one and two sequences launch each kernel before the one before it has
    finished (programmatic dependent launch, Hopper; ``tandem/kernels/triton_support.py``):
    replayed from CUDA graphs, float32 outputs match the oracle (norms, rotary, the K/V write and
    attention launched early), and, for the dense families, bfloat16 ones (the products too)
    equal those of an engine launching plainly, token for token and logprob for logprob."""
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)
    prompts = prompts_for_test()[1:3]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    options = dict(page_size=16, max_total_tokens=480, max_num_batched_tokens=128, max_num_seqs=8)
    llm = LLM(model=model_dirs[arch], device="cuda", dtype="float32", indexer_cache_dtype="float32", **options)
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts, params)
    for output, prompt in zip(outputs, prompts[:1] + prompts):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, 24), context=arch)
    llm.engine.check_all_free()
    del llm
    if arch not in ARCHS:
        return

    def bfloat16_outputs():
        engine = LLM(model=model_dirs[arch], device="cuda", dtype="bfloat16", **options)
        results = engine.generate(prompts[:1], params) + engine.generate(prompts, params)
        engine.engine.check_all_free()
        return [(output.outputs[0].token_ids, [{token: entry.logprob for token, entry in position.items()}
                                               for position in output.outputs[0].logprobs]) for output in results]

    early = bfloat16_outputs()
    monkeypatch.setenv("TANDEM_DISABLE_PDL", "1")
    assert early == bfloat16_outputs()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_rotary_fused_with_the_kv_write_equals_the_separate_launches(arch, kv_cache_dtype, model_dirs, monkeypatch):
    """bfloat16 engines (decode graphs, mixed-step graphs, eager prefills), 16-bit and FP8 K/V:
    rotating in the launch that writes the keys and values (``kernels/rotary_kv_write.py``)
    gives the tokens and logprobs of ``apply_rotary`` then ``write_kv``, exactly (llama). With
    the per-head query/key norms in that launch too (gemma3, qwen3), against ``rms_norm`` of
    each first: the order of the sum of squares moves a normalised element by a bfloat16 step
    at times, so the logprobs agree within 0.05 and the tokens until a near tie."""
    import tandem.kernels.rotary_kv_write as fused_module
    from tandem.kernels.kv_write import write_kv
    from tandem.kernels.norm import rms_norm
    from tandem.kernels.rotary import apply_rotary

    calls = []
    fused = fused_module.rotate_and_write_kv

    def counted(*args, **norms):
        calls.append(norms.get("query_norm") is not None and norms.get("key_norm") is not None)
        return fused(*args, **norms)

    def normalized(heads, norm):
        return heads if norm is None else rms_norm(heads, norm.weight, norm.eps, weight_offset=norm.weight_offset,
                                                   cast_before_weight=norm.cast_before_weight)

    def separate_launches(query, key, value, positions, cos_table, sin_table, key_cache, value_cache, slots,
                          query_norm=None, key_norm=None):
        query, key = apply_rotary(normalized(query, query_norm), normalized(key, key_norm), positions, cos_table,
                                  sin_table)
        write_kv(key, value, key_cache, value_cache, slots)
        return query

    prompts = prompts_for_test()
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)

    def outputs():
        llm = LLM(model=model_dirs[arch], device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                  page_size=16, max_total_tokens=2048, max_num_batched_tokens=128)
        results = llm.generate(prompts, params)
        llm.engine.check_all_free()
        return [(output.outputs[0].token_ids, [{token: entry.logprob for token, entry in position.items()}
                                               for position in output.outputs[0].logprobs]) for output in results]

    monkeypatch.setattr(fused_module, "rotate_and_write_kv", counted)
    with_fused = outputs()
    assert calls and all(calls) == (arch != "llama") and any(calls) == (arch != "llama")
    monkeypatch.setattr(fused_module, "rotate_and_write_kv", separate_launches)
    if arch == "llama":
        assert with_fused == outputs()
    else:
        assert_agree_until_a_near_tie(with_fused, outputs(), tolerance=0.05)


def assert_agree_until_a_near_tie(actual: list, expected: list, tolerance: float) -> None:
    """Per prompt (``(token_ids, [{token: logprob}])``): at each position the logprobs both
    report within ``tolerance``, and the same token, until the first position where the
    tokens differ, which must be a near tie (each token within ``2 * tolerance`` of the other
    in both); after it the sequences go their own ways."""
    compared = 0
    for number, ((tokens, logprobs), (expected_tokens, expected_logprobs)) in enumerate(zip(actual, expected)):
        for position, (token, expected_token) in enumerate(zip(tokens, expected_tokens)):
            entry, expected_entry = logprobs[position], expected_logprobs[position]
            for shared in entry.keys() & expected_entry.keys():
                assert abs(entry[shared] - expected_entry[shared]) <= tolerance, (number, position, shared)
            compared += 1
            if token != expected_token:
                for one, other in ((entry, expected_entry), (expected_entry, entry)):
                    assert token in one and expected_token in one, (number, position, "not a near tie")
                    assert abs(one[token] - one[expected_token]) <= 2 * tolerance, (number, position, "not a near tie")
                break
    assert compared >= len(actual), "no position compared"


FAILED_CAPTURE = """
import torch
from tandem.worker.cuda_graphs import recover_from_failed_capture

device = torch.device("cuda", torch.cuda.current_device())
graph = torch.cuda.CUDAGraph()
with torch.cuda.stream(torch.cuda.Stream()):
    graph.capture_begin()
    try:
        torch.cuda.synchronize()  # refused while capturing: the capture is invalidated
    except RuntimeError:
        print("refused")
    try:
        graph.capture_end()
    except RuntimeError:
        print("capture failed")
try:
    torch.randn(4, device=device)
except RuntimeError as error:
    print("generator stuck:", "Offset increment outside graph capture" in str(error))
recover_from_failed_capture(device)
print("draws after recovery:", bool(torch.randn(4, device=device).isfinite().all()))
"""


def test_a_failed_capture_leaves_the_device_usable():
    """A capture an operation invalidates leaves torch's CUDA generator believing it is still
    capturing, so later random draws fail; ``recover_from_failed_capture`` (what the model
    runner calls when a mixed-step capture fails and it carries on eagerly) clears that. In a
    process of its own: the failed capture's memory pool stays behind in the allocator."""
    import subprocess
    import sys
    from pathlib import Path

    finished = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[2])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.split("\n")[:4] == ["refused", "capture failed", "generator stuck: True",
                                                "draws after recovery: True"], finished.stdout

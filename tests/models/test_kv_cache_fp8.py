"""FP8 K/V cache (``kv_cache_dtype="fp8"``): attention layers' pages hold float8 e4m3 (scale 1.0,
saturated at +-448), everything else keeps its dtype.

FP8 is lossy, so the oracle is ``transformers`` with the same loss: its attention modules'
keys and values (after rotary, as tandem stores them) go through the same FP8 cast before
attention. Against it the engine is held to the ordinary tolerance; against the unquantised
oracle the difference must be far larger, so the comparison can fail when FP8 is not applied.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels.kv_write import cast_for_cache
from tandem.kv.sanitizer import poison_fill
from tests.support.oracle import LOGPROB_TOLERANCE, Oracle, assert_matches
from tests.support.engines import GREEDY, prompts_for

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FP8 = torch.float8_e4m3fn
FP8_ATTENTION = "tandem_fp8_kv"


def fp8_kv_attention(module, query, key, value, *args, **kwargs):
    """transformers' SDPA attention over keys and values rounded through the FP8 cache format."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key = cast_for_cache(key, FP8).to(key.dtype)
    value = cast_for_cache(value, FP8).to(value.dtype)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


@pytest.fixture(scope="module")
def fp8_oracles(model_dirs):
    """arch -> Oracle whose attention reads FP8-rounded keys and values (SDPA's masks, sliding
    windows included, registered under the same name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP8_ATTENTION, fp8_kv_attention)
    AttentionMaskInterface.register(FP8_ATTENTION, sdpa_mask)

    class Oracles(dict):
        def __missing__(self, arch):
            oracle = Oracle(model_dirs[arch])
            oracle.model.set_attn_implementation(FP8_ATTENTION)
            self[arch] = oracle
            return oracle

    return Oracles()


def largest_logprob_difference(reference, other) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(reference.logprobs, other.logprobs))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp8_engine_matches_the_fp8_rounded_oracle(arch, model_dirs, oracles, fp8_oracles):
    """Chunked prefill, a prefix-cache hit and batched decode, all through FP8 pages (gemma3:
    sliding-window layers too)."""
    prompts = prompts_for(5, (40, 3, 70), shared=48)
    llm = LLM(model=model_dirs[arch], kv_cache_dtype="fp8", page_size=16, max_total_tokens=1024,
              max_num_batched_tokens=32, max_num_seqs=8)
    params = SamplingParams(max_tokens=12, **GREEDY)
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert outputs[1].num_cached_tokens >= 48
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], fp8_oracles[arch].greedy(prompt, 12), context=f"{arch} prompt {number}")
    # The comparison has power: FP8 rounding moves the logprobs far beyond the tolerance.
    loss = max(largest_logprob_difference(oracles[arch].greedy(p, 12), fp8_oracles[arch].greedy(p, 12))
               for p in prompts)
    assert loss > 10 * LOGPROB_TOLERANCE, loss
    llm.engine.check_all_free()


def test_fp8_pages_hold_more_tokens_in_the_same_memory(model_dirs, caplog):
    """The pool log line reports the doubled (here: quadrupled) capacity; the disk tier's layout
    fingerprint differs, so FP8 and wider pages are never shared through a disk directory."""
    from tandem.kv.keys import layout_fingerprint
    from tandem.kv.tiers.setup import layout_fingerprint_parts

    budget = 1 << 20
    pools, fingerprints = {}, set()
    for kv_cache_dtype in ("auto", "fp8"):
        with caplog.at_level(logging.INFO, logger="tandem.engine.core"):
            llm = LLM(model=model_dirs["llama"], kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget,
                      page_size=16)
        engine = llm.engine
        pools[kv_cache_dtype] = engine.coordinator.plan.usable_pages
        fingerprints.add(layout_fingerprint(layout_fingerprint_parts(engine.config, engine.coordinator)))
        dtypes = {descriptor.tensor.dtype for descriptor in engine.registry.buffers()}
        assert dtypes == ({FP8} if kv_cache_dtype == "fp8" else {torch.float32})
        tokens = pools[kv_cache_dtype] * 16
        assert f"({tokens} tokens, KV cache {FP8 if kv_cache_dtype == 'fp8' else torch.float32})" in caplog.text
    # float32 model on CPU: an FP8 page is a quarter of the bytes (on a GPU, bf16: half).
    assert pools["auto"] * 4 <= pools["fp8"] + 4 and pools["fp8"] <= pools["auto"] * 4 + 4, pools
    assert len(fingerprints) == 2


def test_hybrid_keeps_recurrent_state_in_the_model_dtype(model_dirs, fp8_oracles):
    llm = LLM(model=model_dirs["qwen3_next"], kv_cache_dtype="fp8_e4m3", max_total_tokens=256)
    dtypes = {(descriptor.kind, descriptor.tensor.dtype) for descriptor in llm.engine.registry.buffers()}
    assert dtypes == {("key", FP8), ("value", FP8), ("conv", torch.float32), ("ssm", torch.float32)}, dtypes
    prompt = prompts_for(6, (21,))[0]
    output = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert_matches(output.outputs[0], fp8_oracles["qwen3_next"].greedy(prompt, 6), context="qwen3_next")


def test_a_model_without_paged_kv_refuses_fp8(model_dirs):
    with pytest.raises(ValueError, match="kv_cache_dtype: .* applies to the paged K/V of attention layers"):
        LLM(model=model_dirs["deepseek_v3"], kv_cache_dtype="fp8", max_total_tokens=256)


def test_flag_and_bad_values_name_the_field(model_dirs):
    from tandem.entrypoints.cli import build_parser, engine_config

    arguments = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"])
    assert engine_config(arguments, "/m").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        LLM(model=model_dirs["llama"], kv_cache_dtype="int8")


def test_fp8_pages_poison_to_nan():
    """I6 for FP8 K/V pages: the poison byte is e4m3's NaN (0x7F), so a stale read is loud."""
    pages = torch.zeros(3, 4, 2, 8, dtype=FP8)
    poison_fill(pages, torch.tensor([1]))
    assert pages[1].float().isnan().all() and not pages[[0, 2]].float().isnan().any()
    packed = torch.zeros(2, 16, dtype=torch.uint8)  # byte-packed state keeps the byte pattern
    poison_fill(packed, torch.tensor([0]))
    assert (packed[0] == 0xA5).all()


@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
def test_swap_and_host_hits_move_fp8_pages_whole(model_dirs, layout):
    """Swap preemption and a host-tier hit carry FP8 pages whole: the outputs equal those of an
    FP8 engine with room for everything (the movers copy bytes, whatever the dtype), laid out
    layer-major; the tight engine's pools in ``layout``."""
    prompts = prompts_for(9, (60, 50, 40, 30))
    params = SamplingParams(max_tokens=16, **GREEDY)
    options = dict(kv_cache_dtype="fp8", page_size=16, max_num_batched_tokens=64)
    expected = LLM(model=model_dirs["llama"], max_total_tokens=2048, **options).generate(prompts, params)
    tight = LLM(model=model_dirs["llama"], max_total_tokens=160, host_cache_size=0.01, preemption_mode="swap",
                kv_cache_layout=layout, **options)
    outputs = tight.generate(prompts, params)
    swaps = tight.engine.stats().tiers.swaps
    assert swaps["out"] > 0 and swaps["in"] == swaps["out"], swaps
    tight.engine.tiers.drain()
    assert tight.engine.reset_prefix_cache() > 0  # the device copies go; the host keeps them
    outputs += tight.generate(prompts[:1], params)
    assert tight.engine.stats().tiers.host_hit_tokens >= 48
    for actual, wanted in zip(outputs, expected + expected[:1]):
        assert actual.outputs[0].token_ids == wanted.outputs[0].token_ids
        for mine, theirs in zip(actual.outputs[0].logprobs, wanted.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) <= LOGPROB_TOLERANCE for t in mine)
    tight.engine.check_all_free()


# --- GPU (``-m gpu``): the Triton kernels, CUDA graphs on ---------------------------------------

requires_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu(test):
    for mark in requires_cuda:
        test = mark(test)
    return test


@gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next"])
def test_gpu_fp8_matches_the_fp8_rounded_oracle(arch, model_dirs, fp8_oracles, monkeypatch):
    """float32 model, FP8 pages, decode in CUDA graphs, chunked prefill and a prefix hit: greedy
    tokens equal and top-5 logprobs within 5e-3 of the FP8-rounded oracle (the GPU's float32
    keys may round to the neighbouring FP8 value where the CPU's do not: on CPU, 1e-6 relative
    noise before the rounding moves these logprobs by up to 4e-5)."""
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 5e-3)
    prompts = prompts_for(5, (40, 3, 70, 1, 200), shared=48)
    llm = LLM(model=model_dirs[arch], device="cuda", dtype="float32", kv_cache_dtype="fp8", page_size=16,
              max_total_tokens=2048, max_num_batched_tokens=64, max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate(prompts[:1], SamplingParams(max_tokens=16, **GREEDY))
    outputs += llm.generate(prompts[1:], SamplingParams(max_tokens=16, **GREEDY))
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], fp8_oracles[arch].greedy(prompt, 16), context=f"{arch} prompt {number}")
    llm.engine.check_all_free()


@gpu
def test_gpu_bf16_model_with_fp8_pages_agrees_with_bf16_pages(model_dirs):
    """bf16 weights, FP8 pages, CUDA graphs: every logprob finite, and at seven steps in ten or
    more the token FP8 decoding picked is also bf16 pages' top-1 (scored teacher-forced: the
    bf16 engine's prompt logprobs over prompt + FP8 output). The tiny test models are far more
    sensitive to K/V rounding than real ones (FP8 moves their logprobs by ~0.2 nats at the
    median); on CPU this workload agrees at 214 of 256 steps (bf16) and 212 (float32), while
    broken pages would agree at almost none."""
    prompts = prompts_for(13, (30, 200, 5, 90, 64, 150, 17, 120))
    greedy = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1, ignore_eos=True)
    fp8 = LLM(model=model_dirs["llama"], device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
              max_total_tokens=4096, max_num_seqs=8)
    assert fp8.engine.runner.graphs is not None
    outputs = [output.outputs[0] for output in fp8.generate(prompts, greedy)]
    values = [entry.logprob for output in outputs for position in output.logprobs for entry in position.values()]
    assert values and all(math.isfinite(value) for value in values)
    fp8.engine.check_all_free()
    del fp8
    bf16 = LLM(model=model_dirs["llama"], device="cuda", dtype="bfloat16", max_total_tokens=4096, max_num_seqs=8)
    scored = bf16.generate([prompt + list(output.token_ids) for prompt, output in zip(prompts, outputs)],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True))
    agree = total = 0
    for prompt, output, score in zip(prompts, outputs, scored):
        for offset, token in enumerate(output.token_ids):
            entry = score.prompt_logprobs[len(prompt) + offset]
            agree += entry[token].rank == 1
            total += 1
    assert agree >= 0.7 * total, f"{agree} of {total} steps agree"

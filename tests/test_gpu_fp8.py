"""FP8 weights on a GPU (``pytest -m gpu tests/test_gpu_fp8.py -s``): every FP8 family's output
with FP8 products and CUDA graphs against the same checkpoint with its weights dequantized at
load (``quantized_compute="dequantized"``), both in bfloat16: greedy agreement over 1,000+
generated tokens of mixed prompts and the logprob error, printed and bounded."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.conftest import ARCH_OPTIONS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILIES = ["llama", "qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"]
MAX_TOKENS = 64
# Wider than the CPU tests' models so that 128x128 blocks are whole and partial (320 = 2.5 blocks)
# and the products take the tensor-core paths (K and N multiples of 16).
SHAPE = dict(hidden_size=256, intermediate_size=320, num_heads=4, num_kv_heads=2)


def mixed_prompts() -> list[list[int]]:
    rng = random.Random(21)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    return ([[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 30, 70, 130, 200, 260, 15, 90, 45)]
            + [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 20, 64, 100, 9, 33)])


def agreement(fp8_outputs, reference_outputs) -> tuple[float, float, int]:
    """(fraction of generated tokens equal to the reference's before the first divergence of
    each sequence, the largest |logprob difference| of the chosen token over those positions,
    tokens compared)."""
    matched = total = 0
    worst = 0.0
    for fp8, reference in zip(fp8_outputs, reference_outputs):
        fp8, reference = fp8.outputs[0], reference.outputs[0]
        total += len(reference.token_ids)
        for position, (token, expected) in enumerate(zip(fp8.token_ids, reference.token_ids)):
            if token != expected:
                break
            matched += 1
            worst = max(worst, abs(fp8.logprobs[position][token].logprob -
                                   reference.logprobs[position][token].logprob))
    return matched / total, worst, total


def make_checkpoint(arch, directory, form):
    from tandem.tools.make_model import make_model

    options = {**ARCH_OPTIONS.get(arch, {}), **SHAPE}
    return str(make_model(arch, directory, seed=1, quantize=form, **options))


@pytest.mark.parametrize("arch, form", [(arch, "fp8") for arch in FAMILIES]
                         + [("llama", "compressed-tensors"), ("qwen3", "compressed-tensors")])
def test_fp8_products_with_cuda_graphs_track_dequantized_weights(arch, form, tmp_path):
    model_dir = make_checkpoint(arch, tmp_path / arch, form)
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192, max_num_batched_tokens=256,
                   max_num_seqs=16, indexer_cache_dtype="float32")
    fp8 = LLM(model=model_dir, quantized_compute="fp8", **options)
    assert fp8.engine.runner.graphs is not None
    assert fp8.engine.model_info.quantization.endswith("/fp8")
    fp8_outputs = fp8.generate(prompts, params)
    fp8.engine.check_all_free()
    fp8_bytes = fp8.engine.model_info.weight_bytes
    del fp8
    reference = LLM(model=model_dir, quantized_compute="dequantized", enforce_eager=True, **options)
    reference_outputs = reference.generate(prompts, params)
    fraction, worst, total = agreement(fp8_outputs, reference_outputs)
    print(f"\n{arch} {form}: greedy agreement {fraction:.3f} over {total} tokens, "
          f"largest logprob error {worst:.4f}, weights {fp8_bytes} vs {reference.engine.model_info.weight_bytes} bytes")
    assert total >= 1000
    assert fp8_bytes < reference.engine.model_info.weight_bytes
    # FP8 activations and weights (3 mantissa bits) against bf16 ones: tiny random models keep
    # wide logit margins, so greedy decoding agrees on most tokens.
    assert fraction >= 0.8 and worst <= 0.25


def test_online_fp8_with_dummy_weights_runs_in_cuda_graphs(tmp_path):
    from tandem.tools.make_model import make_model

    model_dir = str(make_model("llama", tmp_path / "llama", seed=1, weights=False, **SHAPE))
    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", load_format="dummy", quantization="fp8",
              max_total_tokens=2048)
    assert llm.engine.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    outputs = llm.generate([list(range(3, 40))] * 4, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert all(len(output.outputs[0].token_ids) == 32 for output in outputs)
    llm.engine.check_all_free()


def test_memory_freed_by_fp8_weights_goes_to_the_state_pool(tmp_path):
    """Under one ``gpu_memory_utilization``, the FP8 engine's state pool is larger than the bf16
    one's by about the weight bytes FP8 saves (the planner sizes the pool from what the loaded
    weights leave)."""
    import gc

    from tandem.kv.planner import bytes_per_page
    from tandem.tools.make_model import make_model

    model_dir = str(make_model("llama", tmp_path / "llama", seed=1, weights=False, hidden_size=2048, num_layers=8,
                               num_heads=16, num_kv_heads=8, intermediate_size=8192, vocab_size=1024))

    def pool_and_weights(**options) -> tuple[int, int]:
        llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.5,
                  enforce_eager=True, **options)
        engine = llm.engine
        pool = engine.coordinator.plan.num_pages * bytes_per_page(engine.registry, engine.coordinator.page_size)
        weights = engine.model_info.weight_bytes
        engine.shutdown()
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
        return pool, weights

    bf16_pool, bf16_weights = pool_and_weights()
    fp8_pool, fp8_weights = pool_and_weights(quantization="fp8")
    saved = bf16_weights - fp8_weights
    print(f"\nweights {bf16_weights} -> {fp8_weights} bytes; state pool {bf16_pool} -> {fp8_pool} bytes")
    assert saved > 0.4 * bf16_weights * 0.8  # the projections (most of the bytes) halve
    assert abs((fp8_pool - bf16_pool) - saved) <= 0.1 * saved

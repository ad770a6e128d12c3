"""FP8 weights on a GPU (``pytest -m gpu tests/gpu/test_gpu_fp8.py -s``): every FP8 family's FP8
products (CUDA graphs on) against the same checkpoint with its weights dequantized at load
(``quantized_compute="dequantized"``), both in bfloat16, teacher-forced (``tests/support/fp8_agreement.py``):

- scored: both engines score the same 1,000+ positions of long prompts (prefill: the large-M
  products);
- decoded: the FP8 engine decodes greedily from CUDA graphs (the small-M products) and the
  reference scores each of its tokens given the very same prefix.

The bounds are the FP8 algorithm's own error on this model, measured here on the CPU with the
PyTorch references in float32 (the same comparison, no GPU kernel involved), with room for
bfloat16 (8 mantissa bits against e4m3's 3): a kernel that reads a wrong scale, block or tile
lands far outside them (``tests/models/test_fp8_teacher_forced.py`` shows it for ignored scales)."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.support.models import ARCH_OPTIONS
from tests.support.fp8_agreement import Comparison, compare, compare_decoded, long_prompts, score

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILIES = ["llama", "qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"]
DECODED_TOKENS = 96
# Wider than the CPU tests' models so that 128x128 blocks are whole and partial (320 = 2.5 blocks)
# and the products take the tensor-core paths (K and N multiples of 16). Matrices at std 0.05
# (0.8 / sqrt(hidden)): the default wide init makes attention nearly one-hot, so a 3% change of
# one score swaps the winning key and the comparison measures that amplification, not the kernels.
SHAPE = dict(hidden_size=256, intermediate_size=320, num_heads=4, num_kv_heads=2, init_std=0.05)


# Llama with every product in cuBLASLt's block-wise mode (K / 128 a multiple of 4, N whole
# blocks: 128-wide heads, q|k|v = 1,024 rows, gate|up = 2,048, down K = 1,024).
BLOCK_WISE_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_heads=4, num_kv_heads=2, init_std=0.03)


def make_checkpoint(arch, directory, form, shape=None):
    from tandem.tools.make_model import make_model

    options = {**ARCH_OPTIONS.get(arch, {}), **(shape or SHAPE)}
    return str(make_model(arch, directory, seed=1, quantize=form, **options))


def algorithm_error(model_dir: str, sequences: list[list[int]], continued: list[list[int]],
                    starts: list[int]) -> tuple[Comparison, Comparison]:
    """The teacher-forced comparisons on the CPU (PyTorch references in float32): over the
    scored sequences, and over the generated positions of the decoded ones."""
    options = dict(device="cpu", dtype="float32", page_size=16, max_total_tokens=8192, max_num_batched_tokens=512,
                   indexer_cache_dtype="float32")
    everything = sequences + continued
    fp8 = score(LLM(model=model_dir, quantized_compute="fp8", **options), everything)
    reference = score(LLM(model=model_dir, quantized_compute="dequantized", **options), everything)
    count = len(sequences)
    return (compare(fp8[:count], reference[:count], sequences),
            compare(fp8[count:], reference[count:], continued, starts))


def assert_like_the_algorithm(measured: Comparison, algorithm: Comparison, context: str) -> None:
    """Within the CPU reference's error, with room for bfloat16 rounding and sampling noise:
    mean and 99th-percentile logprob errors at most 1.5x (plus 0.02 and 0.05), top-1 agreement
    lower by at most 2 points plus three standard errors, and flips away from near ties
    (reference margin above twice the reference path's 99th-percentile error) at most 1% of
    positions more often, plus three standard errors."""
    message = f"{context}: {measured.describe()}\n  CPU reference: {algorithm.describe()}"
    near_tie = 2 * max(algorithm.quantile(0.99), 0.05)
    assert measured.positions >= 1000 or context.endswith("decoded"), message
    assert measured.mean_error <= 1.5 * algorithm.mean_error + 0.02, message
    assert measured.quantile(0.99) <= 1.5 * algorithm.quantile(0.99) + 0.05, message
    assert measured.agreement >= algorithm.agreement - 0.02 - algorithm.agreement_noise(measured), message
    assert measured.wide_flips(near_tie) <= algorithm.wide_flips(near_tie) + 0.01 + algorithm.flip_noise(
        measured, near_tie), message


@pytest.mark.parametrize("arch, form", [(arch, "fp8") for arch in FAMILIES]
                         + [("llama", "compressed-tensors"), ("qwen3", "compressed-tensors")])
def test_fp8_products_with_cuda_graphs_track_dequantized_weights(arch, form, tmp_path):
    model_dir = make_checkpoint(arch, tmp_path / arch, form)
    sequences = long_prompts(6, 180, seed=21)  # 6 x ~200 = 1,200+ scored positions
    prompts = [sequence[:30 + 20 * number] for number, sequence in enumerate(sequences)]
    options = dict(device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192, max_num_batched_tokens=256,
                   max_num_seqs=16, indexer_cache_dtype="float32")
    fp8 = LLM(model=model_dir, quantized_compute="fp8", **options)
    assert fp8.engine.runner.graphs is not None
    assert fp8.engine.model_info.quantization.endswith("/fp8")
    fp8_scores = score(fp8, sequences)
    decoded = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=DECODED_TOKENS, logprobs=1,
                                                   ignore_eos=True))
    fp8.engine.check_all_free()
    reference = LLM(model=model_dir, quantized_compute="dequantized", enforce_eager=True, **options)
    reference_scores = score(reference, sequences)
    continued = [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, decoded)]
    reference_continued = score(reference, continued)
    assert fp8.engine.model_info.weight_bytes < reference.engine.model_info.weight_bytes
    reference.engine.shutdown()
    del reference

    starts = [len(prompt) - 1 for prompt in prompts]
    algorithm_scored, algorithm_decoded = algorithm_error(model_dir, sequences, continued, starts)
    scored = compare(fp8_scores, reference_scores, sequences)
    decode = compare_decoded(decoded, reference_continued, prompts)
    print(f"\n{arch} {form}\n  scored:  {scored.describe()}\n  CPU reference: {algorithm_scored.describe()}"
          f"\n  decoded: {decode.describe()}\n  CPU reference: {algorithm_decoded.describe()}")
    assert decode.positions == algorithm_decoded.positions == len(prompts) * DECODED_TOKENS
    assert_like_the_algorithm(scored, algorithm_scored, f"{arch} {form} scored")
    assert_like_the_algorithm(decode, algorithm_decoded, f"{arch} {form} decoded")

    # The same kernels reading every linear weight unscaled: far outside the bounds.
    for module in fp8.engine.model.modules():
        if getattr(module, "weight_method", None) is not None:
            module.weight_scale.fill_(1.0)
    with pytest.raises(AssertionError):
        assert_like_the_algorithm(compare(score(fp8, sequences), reference_scores, sequences), algorithm_scored,
                                  f"{arch} {form} unscaled")
    fp8.engine.check_all_free()
    fp8.engine.shutdown()


def linked_producers(llm) -> list[str]:
    return [name for name, module in llm.engine.model.named_modules()
            if getattr(module, "output_quantization", None) is not None]


@pytest.mark.parametrize("form, shape", [("compressed-tensors", SHAPE), ("fp8", SHAPE), ("fp8", BLOCK_WISE_SHAPE)],
                         ids=["per_token", "triton_groups", "block_wise"])
def test_activations_quantized_by_their_producers_leave_every_output_unchanged(form, shape, tmp_path, monkeypatch):
    """The norms and SiLU·mul writing FP8 for the projections after them (CUDA graphs on)
    against the same engine with that fusion unlinked (each product quantizing its own input):
    the fused kernels quantize exactly what the unfused path does, so prompt logprobs (prefill
    products) and greedy tokens with their logprobs (decode graphs) are identical."""
    from tandem.kernels.fp8_activation import QuantizedActivation
    from tandem.kernels.fp8_gemm import BLOCK_WISE_LAYOUT, block_wise_scaled_mm_available

    model_dir = make_checkpoint("llama", tmp_path / "llama", form, shape)
    sequences = long_prompts(4, 180, seed=23)
    prompts = [sequence[:40 + 30 * number] for number, sequence in enumerate(sequences)]
    options = dict(device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192, max_num_batched_tokens=256,
                   max_num_seqs=16)
    greedy = SamplingParams(temperature=0, max_tokens=32, logprobs=3, ignore_eos=True)

    def run(llm):
        results = score(llm, sequences), llm.generate(prompts, greedy)
        llm.engine.check_all_free()
        llm.engine.shutdown()
        return results

    fused = LLM(model=model_dir, quantized_compute="fp8", **options)
    layers = len(fused.engine.model.model.layers)
    assert len(linked_producers(fused)) == 3 * layers  # both norms and the activation of every layer
    down_proj = fused.engine.model.model.layers[0].mlp.down_proj
    layout = down_proj.weight_method.input_layout(down_proj, 256, down_proj.weight.device)
    print(f"\n{form} {shape['hidden_size']}: activations at 256 tokens in {layout}")
    # cuBLASLt's block-wise mode where this GPU and torch take it (SM90, cuBLASLt >= 12.9)
    if shape is BLOCK_WISE_SHAPE and block_wise_scaled_mm_available(down_proj.weight.device):
        assert layout == BLOCK_WISE_LAYOUT
    # the producers write FP8 above the weight-only sizes and 16-bit at one decode token
    layer = fused.engine.model.model.layers[0]
    for tokens, written in ((256, QuantizedActivation), (1, torch.Tensor)):
        hidden = torch.randn(tokens, shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(tokens, 2 * shape["intermediate_size"], device="cuda", dtype=torch.bfloat16)
        assert isinstance(layer.input_layernorm(hidden), written)
        assert isinstance(layer.post_attention_layernorm(hidden, hidden)[0], written)
        assert isinstance(layer.mlp.activation(gate_up), written)
    fused_scores, fused_outputs = run(fused)
    del fused

    monkeypatch.setattr("tandem.quantization.convert.link_quantized_inputs", lambda model: [])
    unfused = LLM(model=model_dir, quantized_compute="fp8", **options)
    assert not linked_producers(unfused)
    unfused_scores, unfused_outputs = run(unfused)

    for fused_positions, unfused_positions in zip(fused_scores, unfused_scores):
        assert [{token: entry.logprob for token, entry in position.items()} for position in fused_positions] == \
            [{token: entry.logprob for token, entry in position.items()} for position in unfused_positions]
    for fused_output, unfused_output in zip(fused_outputs, unfused_outputs):
        assert fused_output.outputs[0].token_ids == unfused_output.outputs[0].token_ids
        assert [{token: entry.logprob for token, entry in position.items()}
                for position in fused_output.outputs[0].logprobs] == \
            [{token: entry.logprob for token, entry in position.items()}
             for position in unfused_output.outputs[0].logprobs]


def test_online_fp8_with_dummy_weights_runs_in_cuda_graphs(tmp_path):
    from tandem.tools.make_model import make_model

    model_dir = str(make_model("llama", tmp_path / "llama", seed=1, weights=False, **SHAPE))
    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", load_format="dummy", quantization="fp8",
              max_total_tokens=2048)
    assert llm.engine.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    outputs = llm.generate([list(range(3, 40))] * 4, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert all(len(output.outputs[0].token_ids) == 32 for output in outputs)
    llm.engine.check_all_free()


def test_memory_freed_by_fp8_weights_goes_to_the_state_pool(tmp_path, monkeypatch):
    """Under one ``gpu_memory_utilization``, the FP8 engine's state pool is larger than the bf16
    one's by the weight bytes FP8 saves. The planner sizes the pool from the device's free memory
    when it plans (no profiling pass: activations and workspaces come later, from what
    ``gpu_memory_utilization`` leaves), so the only other difference can be what the caching
    allocator holds unused at that moment: loading releases its temporaries and the conversion
    allocates FP8 weights only after every 16-bit one is freed (``convert_model``), so that
    slack stays within three of the allocator's 20 MiB segments (weights under 10 MB share
    them: a 4 MiB embedding, 8 MiB o_proj, 4 MiB FP8 o_proj) in either engine (measured on an
    H100: 59.7 MB in the 16-bit engine, 42.1 MB in the FP8 one)."""
    import gc

    import tandem.engine.state_setup as state_setup
    from tandem.kv.planner import bytes_per_page
    from tandem.tools.make_model import make_model

    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests in this process left cached is not the engines' slack
    model_dir = str(make_model("llama", tmp_path / "llama", seed=1, weights=False, hidden_size=2048, num_layers=8,
                               num_heads=16, num_kv_heads=8, intermediate_size=8192, vocab_size=1024))
    at_planning = {}
    budget_of = state_setup.state_memory_budget

    def recorded_budget(*args, **kwargs):
        at_planning.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                           used=torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0])
        return budget_of(*args, **kwargs)

    monkeypatch.setattr(state_setup, "state_memory_budget", recorded_budget)

    def pool_and_memory(**options) -> tuple[int, int, dict]:
        llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.5,
                  enforce_eager=True, **options)
        engine = llm.engine
        page_bytes = bytes_per_page(engine.registry, engine.coordinator.page_size)
        pool = engine.coordinator.plan.num_pages * page_bytes
        weights = engine.model_info.weight_bytes
        engine.shutdown()
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
        return pool, weights, {**at_planning, "page": page_bytes}

    bf16_pool, bf16_weights, bf16 = pool_and_memory()
    fp8_pool, fp8_weights, fp8 = pool_and_memory(quantization="fp8")
    saved = bf16_weights - fp8_weights
    slack = {name: memory["reserved"] - memory["allocated"] for name, memory in (("bf16", bf16), ("fp8", fp8))}
    print(f"\nweights {bf16_weights} -> {fp8_weights} bytes (saved {saved}); state pool {bf16_pool} -> {fp8_pool} "
          f"(grew {fp8_pool - bf16_pool}); at planning: allocated {bf16['allocated']} -> {fp8['allocated']}, "
          f"allocator slack {slack['bf16']} -> {slack['fp8']}, device used {bf16['used']} -> {fp8['used']}")
    assert saved > 0.4 * bf16_weights * 0.8  # the projections (most of the bytes) halve
    # Allocated at planning: at least the weight bytes saved fewer (the scales are in weight_bytes;
    # measured on an H100: 23.6 MB more, allocations of the 16-bit engine's load that the FP8
    # conversion releases).
    assert (bf16["allocated"] - fp8["allocated"]) - saved >= -(1 << 20)
    assert max(slack.values()) <= 3 * (20 << 20)
    # The pool takes what the device's used memory leaves, to the page.
    assert abs((fp8_pool - bf16_pool) - (bf16["used"] - fp8["used"])) <= 2 * bf16["page"] + (2 << 20)
    assert fp8_pool - bf16_pool >= 0.95 * saved  # the bytes FP8 saves go to the state pool

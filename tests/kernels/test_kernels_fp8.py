"""FP8 matrix products (``tandem/kernels/fp8_gemm.py``) against their PyTorch references: the
per-token-group activation quantization and the block-scaled GEMM interpreted on CPU with tiny,
odd shapes (partial groups, partial tiles); on a GPU (``-m gpu``) both paths (``_scaled_mm``
row-wise, Triton block-scaled) at Llama-3.1-8B shapes, eager and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_gemm import (FP8_DTYPE, BlockGemmConfig, block_scaled_matmul, block_scaled_matmul_reference,
                                     fp8_linear, fp8_linear_reference, quantize_token_groups,
                                     quantize_token_groups_reference)
from tandem.quantization.fp8 import quantize_blocks, quantize_rows, row_block_scales
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def random(*shape, seed, device="cpu", dtype=torch.float32, scale=1.0):
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)


def on_the_fp8_grid(tokens, features, group, seed, device="cpu"):
    """Activations whose quantization is exact in any rounding mode (Triton's interpreter does
    not round float32 -> e4m3 to nearest): FP8 values with 448 in every group, times a power of
    two per group, so each group's scale is that power of two."""
    values = random(tokens, features, seed=seed, scale=100.0).clamp(-440, 440).to(FP8_DTYPE).float()
    values[:, ::group] = 448.0
    powers = torch.randint(-6, 6, (tokens, -(-features // group)), generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(powers.float()).repeat_interleave(group, dim=1)[:, :features]).to(device)


@pytest.mark.parametrize("tokens, features, group", [(5, 40, 16), (3, 40, 40), (1, 64, 32)])
def test_activation_quantization_kernel_equals_reference(tokens, features, group):
    hidden = on_the_fp8_grid(tokens, features, group, seed=1)
    hidden[0, :group] = 0.0  # an all-zero group: zeros, not NaN
    quantized, scales = quantize_token_groups(hidden, group)
    expected_quantized, expected_scales = quantize_token_groups_reference(hidden, group)
    assert quantized.dtype == FP8_DTYPE and scales.shape == (tokens, -(-features // group))
    assert torch.equal(quantized.float(), expected_quantized.float())
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    assert quantized.float()[0, :group].abs().max() == 0
    groups = scales.repeat_interleave(group, dim=1)[:, :features]
    assert torch.equal(quantized.float() * groups, hidden)


def test_reference_quantization_rounds_to_nearest_within_half_a_step():
    hidden = random(5, 40, seed=8, scale=3.0)
    quantized, scales = quantize_token_groups_reference(hidden, 16)
    groups = scales.repeat_interleave(16, dim=1)[:, :40]
    error = (quantized.float() * groups - hidden).abs()
    assert (error <= hidden.abs() * 2 ** -4 + groups * 2 ** -9).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("tokens, rows, features, group, config", [
    (5, 24, 40, 16, None), (1, 72, 48, 16, None), (33, 20, 64, 32, None),
    # 3 row tiles x 5 column tiles walked in bands of 2 row tiles (the last band partial)
    (40, 72, 48, 16, BlockGemmConfig(block_m=16, block_n=16, warps=4, stages=2, swizzle_m=2)),
])
def test_block_scaled_gemm_equals_reference(tokens, rows, features, group, config):
    weight, weight_scale = quantize_blocks(random(rows, features, seed=2), (group, group))
    row_scales = row_block_scales(weight_scale, (rows, features), (group, group))
    quantized, scales = quantize_token_groups_reference(random(tokens, features, seed=3), group)
    expected = block_scaled_matmul_reference(quantized, scales, weight, row_scales, group, torch.float32)
    actual = block_scaled_matmul(quantized, scales, weight, row_scales, group, torch.float32, config)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_reference_product_is_within_fp8_error_of_the_float_product():
    hidden, weight = random(7, 48, seed=4), random(24, 48, seed=5)
    quantized, scale = quantize_rows(weight)
    dequantized = quantized.float() * scale
    exact = hidden @ dequantized.t()
    for group in (None, 16):
        approximate = fp8_linear_reference(hidden, quantized, scale if group is None else
                                           scale.expand(24, 3).contiguous(), group)
        # activations rounded to e4m3 (3 mantissa bits): a few percent of the product's size
        assert 0 < (approximate - exact).abs().max() <= 0.08 * exact.abs().max()


def gpu_case(tokens, rows, features, group, seed):
    weight, weight_scale = (quantize_rows if group is None else
                            lambda w: quantize_blocks(w, (group, group)))(random(rows, features, seed=seed) * 0.02)
    row_scales = row_block_scales(weight_scale, (rows, features), None if group is None else (group, group))
    hidden = random(tokens, features, seed=seed + 1, device="cuda", dtype=torch.bfloat16)
    return hidden, weight.cuda(), row_scales.cuda()


# Llama-3.1-8B's projections: qkv, o, gate_up, down (N, K).
LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("tokens", [1, 16, 512])
@pytest.mark.parametrize("rows, features", LLAMA_8B_SHAPES)
def test_gpu_fp8_products_equal_reference(rows, features, tokens, group):
    hidden, weight, weight_scale = gpu_case(tokens, rows, features, group, seed=6)
    expected = fp8_linear_reference(hidden, weight, weight_scale, group).float()
    actual = fp8_linear(hidden, weight, weight_scale, group).float()
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_fp8_products_replay_from_a_cuda_graph(group):
    hidden, weight, weight_scale = gpu_case(16, 4096, 4096, group, seed=7)
    eager = fp8_linear(hidden, weight, weight_scale, group)
    static = hidden.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fp8_linear(static, weight, weight_scale, group)  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fp8_linear(static, weight, weight_scale, group)
    static.copy_(hidden)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(output, eager)


@pytest.mark.parametrize("group", [16, 32, None])  # None: one scale per row (per channel)
def test_fused_moe_with_fp8_experts_equals_reference_on_dequantized_experts(group):
    from tandem.kernels.fused_moe import dequantize_experts, fused_moe, fused_moe_reference

    experts, hidden_size, intermediate, tokens, top_k = 4, 48, 40, 7, 2  # 40 inputs: a partial group
    generator = torch.Generator().manual_seed(10)
    w1 = torch.randn(experts, 2 * intermediate, hidden_size, generator=generator) * hidden_size ** -0.5
    w2 = torch.randn(experts, hidden_size, intermediate, generator=generator) * intermediate ** -0.5
    quantized, groups = [], []
    for weights in (w1, w2):
        columns = group or weights.shape[-1]
        pairs = [quantize_blocks(matrix, (1, columns)) for matrix in weights]  # one scale per row and group
        quantized.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        groups.append(columns)
    (w1_fp8, w1_scale), (w2_fp8, w2_scale) = quantized
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    expert_ids = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
    routing = torch.rand(tokens, top_k, generator=generator)
    expected = fused_moe_reference(hidden, dequantize_experts(w1_fp8, w1_scale, groups[0], torch.float32),
                                   dequantize_experts(w2_fp8, w2_scale, groups[1], torch.float32), routing, expert_ids)
    actual = fused_moe(hidden, w1_fp8, w2_fp8, routing, expert_ids, w1_scale=w1_scale, w2_scale=w2_scale,
                       scale_groups=tuple(groups))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, fused_moe_reference(hidden, w1, w2, routing, expert_ids), atol=1e-6)


def test_block_scaled_gemm_compiles_to_pipelined_wgmma_on_h100():
    """Checked without a GPU (``tests/support/triton_aot.py``): at large M the block-scaled GEMM's FP8
    tiles stream through pipelined 16-byte asynchronous copies into Hopper's warp-group MMA."""
    pytest.importorskip("triton")
    from tandem.kernels.fp8_gemm import block_gemm_config
    from tests.support.triton_aot import compile_request, ptx_for_h100

    config = block_gemm_config(4096)
    signature = {"a": "*fp8e4nv", "a_scale": "*fp32", "b": "*fp8e4nv", "b_scale": "*fp32", "c": "*bf16",
                 "M": "i32", "N": "i32", "stride_a": "i32", "stride_b": "i32", "stride_c": "i32"}
    constexprs = {"K": 4096, "GROUP": 128, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                  "SWIZZLE_M": config.swizzle_m, "UPCAST": False}
    ptx, = ptx_for_h100([compile_request("tandem.kernels.fp8_gemm", "_block_scaled_gemm", signature, constexprs,
                                         warps=config.warps, stages=config.stages, unaligned=("M",))])
    copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
    assert copies and all(", 0x10" in line for line in copies), copies[:3]
    assert "wgmma.mma_async" in ptx and "e4m3" in ptx


def test_block_wise_scales_take_whole_128_blocks_only():
    """cuBLASLt's block-wise layout (``[K/128, N/128]``, K-major) from the row-block scales, and
    None wherever that mode would read them wrongly."""
    from tandem.kernels.fp8_gemm import block_wise_scales

    blocks = torch.rand(3, 8) + 0.5  # N = 384 rows, K = 1,024 inputs
    rows = blocks.repeat_interleave(128, dim=0)
    layout = block_wise_scales(rows, 128)
    assert layout.shape == (8, 3) and layout.stride() == (1, 8) and torch.equal(layout, blocks.t())
    assert block_wise_scales(rows[64:320], 128) is None  # a shard cut inside a block
    assert block_wise_scales(rows[:, :6], 128) is None  # K/128 = 6: not a multiple of 4
    assert block_wise_scales(rows, 64) is None and block_wise_scales(rows[:, :1], None) is None


def test_quantized_groups_padded_with_token_major_scales():
    from tandem.kernels.fp8_gemm import quantize_token_groups, quantize_token_groups_reference

    hidden = on_the_fp8_grid(5, 256, 128, seed=3)  # values the two roundings agree on
    quantized, scales = quantize_token_groups(hidden, 128, padded_tokens=8, token_major_scales=True)
    expected_quantized, expected_scales = quantize_token_groups_reference(hidden, 128)
    assert quantized.shape == (8, 256) and scales.shape == (8, 2) and scales.stride() == (1, 8)
    torch.testing.assert_close(scales[:5], expected_scales)
    assert torch.equal(quantized[:5].float(), expected_quantized.float())
    assert not quantized[5:].float().any() and torch.equal(scales[5:], torch.ones(3, 2))


@pytest.mark.gpu
@requires_cuda
def test_gpu_block_weights_take_cublas_block_wise_products_above_decode_sizes():
    """128x128 block weights at prefill sizes: cuBLASLt's block-wise ``_scaled_mm`` (on SM90)
    equals the reference product with the same activation rounding, eager and in a graph."""
    from tandem.kernels.fp8_gemm import block_wise_scaled_mm_available, fp8_linear_reference
    from tandem.quantization.fp8 import quantize_blocks, row_block_scales
    from tandem.quantization.linear_method import Fp8LinearMethod

    if not block_wise_scaled_mm_available(torch.device("cuda")):
        pytest.skip("no cuBLASLt block-wise FP8 products on this GPU")
    float_weight = torch.randn(4096, 4096) * 0.02
    weight, blocks = quantize_blocks(float_weight, (128, 128))
    module = torch.nn.Module()
    module.weight, module.weight_scale = weight.cuda(), row_block_scales(blocks, (4096, 4096), (128, 128)).cuda()
    method = Fp8LinearMethod(128)
    for tokens in (17, 512, 4097):  # above the weight-only sizes; 17 and 4,097: rows padded to a multiple of 4
        hidden = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        expected = fp8_linear_reference(hidden, module.weight, module.weight_scale, 128).float()
        actual = method.apply(module, hidden, None).float()
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
    assert module.weight_block_wise_scales is not None
    static = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    eager = method.apply(module, static, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = method.apply(module, static, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(output, eager)

"""Fused elementwise kernels (``tandem/kernels``: norm, rotary, activation, kv_write) against
their plain-PyTorch references, and the references against the unfused formulas the models
used before.

On CPU the kernels run through Triton's interpreter with tiny, odd shapes. The interpreter
rounds float32 -> bfloat16 towards zero (a GPU rounds to nearest), so bfloat16 is compared
within a few bfloat16 steps there; float32 is compared to ~1e-6. ``-m gpu`` repeats the
comparisons at Llama-3.1-8B shapes, where bfloat16 is held to about one rounding step, and
checks that every kernel replays from a CUDA graph.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.activation import (gelu_and_mul, gelu_and_mul_reference, gelu_tanh_and_mul,
                                       gelu_tanh_and_mul_reference, silu_and_mul, silu_and_mul_reference)
from tandem.kernels.kv_write import write_kv, write_kv_reference
from tandem.kernels.norm import rms_norm, rms_norm_reference
from tandem.kernels.rotary import apply_rotary, apply_rotary_reference
from tandem.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FLAVOURS = {"llama": dict(weight_offset=0.0, cast_before_weight=True),
            "gemma": dict(weight_offset=1.0, cast_before_weight=False)}
ACTIVATIONS = {"silu": (silu_and_mul, silu_and_mul_reference),
               "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_reference),
               "gelu": (gelu_and_mul, gelu_and_mul_reference)}
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)


def gpu(test):
    """Marks ``test`` as a GPU test, skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(test))


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: ~1e-6 of the largest magnitude; bfloat16: a few rounding steps (interpreter) or
    about one (GPU)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)
    else:
        tolerance = 2 ** -7 if actual.is_cuda else 3 * 2 ** -7
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator(seed)) * scale).to(device=DEVICE, dtype=dtype)


def qkv_views(tokens, query_heads, key_heads, head_dim, dtype, seed):
    """query, key, value as strided views of one fused projection output, as the models have them."""
    fused = random((tokens, (query_heads + 2 * key_heads) * head_dim), dtype, seed)
    query, key, value = fused.split([query_heads * head_dim, key_heads * head_dim, key_heads * head_dim], dim=-1)
    return (query.reshape(tokens, query_heads, head_dim), key.reshape(tokens, key_heads, head_dim),
            value.reshape(tokens, key_heads, head_dim))


# --- RMSNorm -------------------------------------------------------------------------------

def check_rms_norm(shape, dtype, flavour, with_residual, seed=0):
    x = random(shape, dtype, seed)
    weight = random(shape[-1:], dtype, seed + 1, scale=0.5)
    residual = random(shape, dtype, seed + 2) if with_residual else None
    options = dict(residual=residual, **FLAVOURS[flavour])
    actual = rms_norm(x, weight, 1e-6, **options)
    expected = rms_norm_reference(x, weight, 1e-6, **options)
    if with_residual:
        assert_near(actual[0], expected[0])
        assert_near(actual[1], expected[1])
        if CUDA:
            assert torch.equal(actual[1], expected[1])  # one rounding of one sum
    else:
        assert_near(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 80), (3, 96), (4, 3, 24)])
def test_rms_norm_matches_reference(shape, with_residual, flavour, dtype):
    check_rms_norm(shape, dtype, flavour, with_residual)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_rms_norm_per_head_reads_strided_views(flavour):
    query, key, _ = qkv_views(3, 4, 2, 40, torch.float32, seed=5)
    weight = random((40,), torch.float32, 6)
    for heads in (query, key):
        assert not heads.is_contiguous()
        actual = rms_norm(heads, weight, 1e-5, **FLAVOURS[flavour])
        assert_near(actual, rms_norm_reference(heads.contiguous(), weight, 1e-5, **FLAVOURS[flavour]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_the_unfused_formula(dtype):
    """Bit for bit: Llama's ``weight * normed.to(dtype)`` and Gemma's float32 ``(1 + weight)``
    product, each after the unfused ``residual + hidden``."""
    x, residual = random((4, 48), dtype, 1), random((4, 48), dtype, 2)
    weight = random((48,), dtype, 3)
    summed = residual + x
    hidden = summed.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    llama = weight * normed.to(dtype)
    gemma = (normed * (1.0 + weight.float())).type_as(summed)
    for flavour, expected in (("llama", llama), ("gemma", gemma)):
        out, new_residual = rms_norm_reference(x, weight, 1e-6, residual=residual, **FLAVOURS[flavour])
        assert torch.equal(out, expected) and torch.equal(new_residual, summed)


# --- rotary --------------------------------------------------------------------------------

def check_rotary(tokens, query_heads, key_heads, head_dim, rotary_dim, dtype, max_positions, seed=0):
    rotary = RotaryEmbedding(rotary_dim, LLAMA3_ROPE, max_positions).to(DEVICE)
    query, key, _ = qkv_views(tokens, query_heads, key_heads, head_dim, dtype, seed)
    positions = torch.randint(0, max_positions, (tokens,), generator=generator(seed + 1)).to(DEVICE)
    query_before, key_before = query.clone(), key.clone()
    actual = apply_rotary(query, key, positions, rotary.cos_table, rotary.sin_table)
    expected = apply_rotary_reference(query, key, positions, rotary.cos_table, rotary.sin_table)
    assert torch.equal(query, query_before) and torch.equal(key, key_before)  # out of place
    assert_near(actual[0], expected[0])
    assert_near(actual[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 32, 32), (3, 1, 24, 24), (4, 2, 40, 16), (5, 1, 18, 10)],
                         ids=["gqa", "odd-heads", "partial", "partial-odd"])
def test_rotary_matches_reference(heads, dtype):
    check_rotary(5, *heads, dtype, max_positions=300)


def test_rotary_reference_is_the_unfused_formula():
    rotary = RotaryEmbedding(32, LLAMA3_ROPE, 100)
    query, key = random((3, 4, 32), torch.bfloat16, 1), random((3, 2, 32), torch.bfloat16, 2)
    positions = torch.tensor([0, 57, 99])
    cos = rotary.cos_table[positions].unsqueeze(1).to(torch.bfloat16)
    sin = rotary.sin_table[positions].unsqueeze(1).to(torch.bfloat16)

    def unfused(x):
        return x * cos + torch.cat((-x[..., 16:], x[..., :16]), dim=-1) * sin

    actual = apply_rotary_reference(query, key, positions, rotary.cos_table, rotary.sin_table)
    assert torch.equal(actual[0], unfused(query)) and torch.equal(actual[1], unfused(key))


# --- gated activations ---------------------------------------------------------------------

def check_activation(name, shape, dtype, seed=0):
    kernel, reference = ACTIVATIONS[name]
    x = random(shape, dtype, seed, scale=3.0)
    assert_near(kernel(x), reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(3, 160), (2, 3, 96), (1, 2 * 1100)])
def test_gated_activation_matches_reference(shape, name, dtype):
    check_activation(name, shape, dtype)


def test_gelu_tanh_reference_is_gemmas_activation():
    x = random((3, 64), torch.bfloat16, 1, scale=3.0)
    gate, up = x[:, :32], x[:, 32:]
    assert torch.equal(gelu_tanh_and_mul_reference(x), F.gelu(gate, approximate="tanh") * up)
    assert torch.equal(silu_and_mul_reference(x), F.silu(gate) * up)


# --- KV write ------------------------------------------------------------------------------

def poisoned_caches(num_pages, page_size, heads, head_dim, dtype, padded_dim=None):
    """Two pairs of NaN-filled caches; with ``padded_dim`` they are strided views."""
    full = torch.full((4, num_pages, page_size, heads, padded_dim or head_dim), float("nan"), device=DEVICE)
    caches = full.to(dtype)[..., :head_dim]
    return (caches[0], caches[1]), (caches[2], caches[3])


def same_with_poison(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, NaN where the other is NaN (unwritten slots stay poisoned)."""
    assert torch.equal(actual.isnan(), expected.isnan())
    assert_near(actual.nan_to_num(0.0), expected.nan_to_num(0.0))


def check_write_kv(tokens, heads, head_dim, num_pages, page_size, dtype, cache_dtype, slot_dtype,
                   padded_dim=None, seed=0):
    _, key, value = qkv_views(tokens, heads, heads, head_dim, dtype, seed)
    slots = torch.randperm(num_pages * page_size, generator=generator(seed + 1))[:tokens]
    slots[torch.arange(tokens) % 3 == 1] = -1  # padding rows
    slots = slots.to(device=DEVICE, dtype=slot_dtype)
    kernel_caches, reference_caches = poisoned_caches(num_pages, page_size, heads, head_dim, cache_dtype, padded_dim)
    write_kv(key, value, *kernel_caches, slots)
    write_kv_reference(key, value, *reference_caches, slots)
    untouched = (num_pages * page_size - int((slots >= 0).sum())) * heads * head_dim
    assert int(kernel_caches[0].isnan().sum()) == untouched
    for actual, expected in zip(kernel_caches, reference_caches):
        if cache_dtype.itemsize == 1:  # FP8: the same rounding (-0 and +0 alike), poison where it was
            assert torch.equal(actual.float().isnan(), expected.float().isnan())
            assert torch.equal(actual.float().nan_to_num(0.0), expected.float().nan_to_num(0.0))
        else:
            same_with_poison(actual, expected)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference_and_skips_padding(dtype, cache_dtype, slot_dtype):
    check_write_kv(7, 3, 80, 3, 5, dtype, cache_dtype, slot_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_saturates_fp8(dtype):
    """FP8 caches store values beyond +-448 as +-448 (never NaN); in range they round to the
    nearest e4m3 value (within half a step: 2**-4 relative)."""
    fp8 = torch.float8_e4m3fn
    key = torch.tensor([[[1000.0, -1000.0, 448.0, 3.3, -0.02, 500.0, -449.0, 7.0]]], device=DEVICE).to(dtype)
    value = -key
    slots = torch.tensor([1], device=DEVICE, dtype=torch.int32)
    for write in (write_kv, write_kv_reference):
        caches = poisoned_caches(1, 2, 1, 8, fp8)[0]
        write(key, value, *caches, slots)
        stored = caches[0][0, 1, 0].float()
        expected = key[0, 0].float().clamp(-448, 448)
        assert not stored.isnan().any(), write.__name__
        torch.testing.assert_close(stored, expected, rtol=2 ** -4, atol=0.0)
        torch.testing.assert_close(caches[1][0, 1, 0].float(), -stored, rtol=0.0, atol=0.0)
        assert caches[0][0, 0].float().isnan().all()  # the other slot stays poisoned


def test_write_kv_honours_cache_strides():
    check_write_kv(6, 2, 24, 4, 4, torch.float32, torch.float32, torch.int64, padded_dim=32)


# --- edges and installs --------------------------------------------------------------------

def test_empty_batches_launch_nothing():
    x = random((0, 48), torch.float32, 0)
    assert rms_norm(x, random((48,), torch.float32, 1), 1e-6).shape == (0, 48)
    assert silu_and_mul(x).shape == (0, 24)
    rotary = RotaryEmbedding(16, None, 8)
    query, key = apply_rotary(random((0, 2, 16), torch.float32, 0), random((0, 1, 16), torch.float32, 0),
                              torch.zeros(0, dtype=torch.long), rotary.cos_table, rotary.sin_table)
    assert query.shape == (0, 2, 16) and key.shape == (0, 1, 16)


def test_references_import_without_triton():
    """A CPU install without the dev extra has no Triton: the modules import, references run."""
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch\n"
              "from tandem.kernels.norm import rms_norm_reference\n"
              "from tandem.kernels.rotary import apply_rotary_reference\n"
              "from tandem.kernels.activation import silu_and_mul_reference\n"
              "from tandem.kernels.kv_write import write_kv_reference\n"
              "from tandem.kernels.rotary_kv_write import rotate_and_write_kv_reference\n"
              "from tandem.layers.norm import RMSNorm\n"
              "print(RMSNorm(8)(torch.ones(2, 8)).sum().item())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert abs(float(result.stdout) - 16.0) < 1e-3


# --- GPU: Llama-3.1-8B shapes, CUDA graphs -------------------------------------------------

TOKENS = [1, 256, 4096]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gpu
def test_rms_norm_gpu(dtype, with_residual, flavour, tokens):
    check_rms_norm((tokens, 4096), dtype, flavour, with_residual)
    check_rms_norm((tokens, 32, 128), dtype, flavour, with_residual=False)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gpu
def test_rotary_gpu(dtype, tokens):
    check_rotary(tokens, 32, 8, 128, 128, dtype, max_positions=8192)
    check_rotary(tokens, 16, 2, 256, 64, dtype, max_positions=8192)  # partial rotary (Qwen3-Next)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gpu
def test_gated_activation_gpu(dtype, name, tokens):
    check_activation(name, (tokens, 2 * 14336), dtype)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@gpu
def test_write_kv_gpu(cache_dtype, tokens):
    check_write_kv(tokens, 8, 128, 600, 16, torch.bfloat16, cache_dtype, torch.int32)


@gpu
def test_kernels_replay_from_a_cuda_graph():
    """Captured once, replayed on new inputs copied into the same buffers: same as eager."""
    tokens, hidden = 8, 4096
    rotary = RotaryEmbedding(128, LLAMA3_ROPE, 4096).to(DEVICE)
    weight = random((hidden,), torch.bfloat16, 0)
    inputs = dict(x=random((tokens, hidden), torch.bfloat16, 1), residual=random((tokens, hidden), torch.bfloat16, 2),
                  query=random((tokens, 32, 128), torch.bfloat16, 3), key=random((tokens, 8, 128), torch.bfloat16, 4),
                  gate_up=random((tokens, 2 * 1024), torch.bfloat16, 5),
                  positions=torch.arange(tokens, device=DEVICE),
                  slots=torch.tensor([5, -1, 7, 9, -1, 11, 12, 40], device=DEVICE, dtype=torch.int32))
    caches = [torch.zeros(4, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]

    def step():
        out, new_residual = rms_norm(inputs["x"], weight, 1e-5, residual=inputs["residual"])
        query, key = apply_rotary(inputs["query"], inputs["key"], inputs["positions"],
                                  rotary.cos_table, rotary.sin_table)
        write_kv(key, inputs["query"][:, :8], *caches, inputs["slots"])
        return out, new_residual, query, key, silu_and_mul(inputs["gate_up"])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed, tensor in enumerate(inputs.values()):
        if tensor.is_floating_point():
            tensor.copy_(random(tensor.shape, tensor.dtype, seed=seed + 10))
    inputs["positions"].copy_(torch.arange(100, 100 + tokens, device=DEVICE))
    graph.replay()
    replayed_caches = [cache.clone() for cache in caches]
    for cache in caches:
        cache.zero_()
    eager = step()
    for replayed, expected in zip(captured, eager):
        assert torch.equal(replayed, expected)
    for replayed, expected in zip(replayed_caches, caches):
        assert torch.equal(replayed, expected)
